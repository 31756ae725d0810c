export CUPY_CACHE_DIR=$PWD/.kcache PYTHONPATH=$PWD
start=$(date +%s)
{
for dt in float16 bfloat16; do
  for D in 160 224; do for k in flash2_fwd_wg flash2_bwd_wg flash2_bwd_wg_det; do echo $k $dt $D 0 0 0; echo $k $dt $D 0 0 1; done; done
done
echo flash2_fwd_tc float16 96 0 0 0; echo flash2_fwd_tc float16 96 0 0 1
} | xargs -P 16 -L 1 python3 scratch/nvrtc_check.py 2>&1 | grep -v Warn | grep -v "^ok" | head -5
echo "compile $(( $(date +%s) - start )) s"
python3 scratch/san14.py wg,tc 2>&1 | grep -v Warn | tail -2
echo "smoke $(( $(date +%s) - start )) s"
for tool in memcheck initcheck synccheck racecheck; do
  timeout 100 compute-sanitizer --tool $tool --error-exitcode 1 python3 scratch/san14.py wg,tc 2>&1 | grep -v Warn | tail -2
  echo "$tool rc=$? $(( $(date +%s) - start )) s"
done
