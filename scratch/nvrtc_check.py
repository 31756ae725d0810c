"""Scratch: compile one instance (as flashsim.gpu does) and print NVRTC's log on failure.
usage: nvrtc_check.py name dtype D var vl io"""
import sys, time
from flashsim.gpu import _device as Dv
name, dt, D, var, vl, io = sys.argv[1], sys.argv[2], int(sys.argv[3]), *(a == "1" for a in sys.argv[4:7])
t = time.time()
try:
    Dv.kernel(name, dt, io, D, var, vl)
    print("ok", *sys.argv[1:], round(time.time() - t, 1), flush=True)
except Exception as e:
    print("FAILED", *sys.argv[1:], str(e)[-4000:], flush=True)
