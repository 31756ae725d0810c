def softmax(*a, **k):
    raise NotImplementedError
