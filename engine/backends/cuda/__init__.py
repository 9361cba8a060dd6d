"""The CUDA backend (backend.CudaBackend), one job a module:

- backend.py: the device and its context, the step protocol (launch and wait, steps in flight)
- weights.py: the weights uploaded in their formats; linear.py: a linear weight and the products by it
- buffers.py: a step's device memory, and the paged KV cache
- step_metadata.py: a step's shape and its metadata array (pure numpy)
- forward.py: a step's forward pass, each layer's ops launched as our kernels
- step_graphs.py: decode steps and short prompt chunks captured as CUDA graphs; graph.py: the driver calls behind them
- sampler.py: penalties and sampling on the GPU
- kernels.py: cuda_src/'s kernels compiled, each with its launcher; cublas.py: cuBLAS GEMMs

Only kernels.py and step_metadata.py import without PyCUDA.
"""
