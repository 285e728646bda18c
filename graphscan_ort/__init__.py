"""graphscan's commands that run models, in onnxruntime.

``graphscan.py`` (the onnx-only core beside this package) imports a module of
it only when one of these commands is asked for:

- ``fuse``: MatMul + Add -> Gemm, verified before it is written;
- ``trace`` (with ``combined``): per-operator isolated and propagated error;
- ``runtime`` (with ``timing``): what onnxruntime really runs, and its time;
- ``impact`` (with ``segments``): the output SQNR each operator costs;
- ``check``: the budgets that run the model.

``common`` and ``inputs`` are the shared layer: sessions, the blame message,
output pairing, the output SQNR, atomic writes, and model inputs.
"""
