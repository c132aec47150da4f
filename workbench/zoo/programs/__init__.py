"""The zoo programs, one real upstream CUDA-graph bug per module (see ``workbench.zoo``)."""
