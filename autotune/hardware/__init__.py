"""The machine: the GPU catalog and detection, CUDA device numbering, NVML, links between cards,
and where a configuration's layers go."""
