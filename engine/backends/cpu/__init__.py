"""The CPU backend (backend.CpuBackend): cpu_src/'s kernels, compiled for this CPU.

- backend.py: the numpy backend's step with its ops run by the kernels
- weights.py: every checkpoint format repacked into the forms the kernels read
- kernels.py: cpu_src/ compiled once and cached, each function bound to its argument types
"""
