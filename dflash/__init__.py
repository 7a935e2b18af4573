"""dflash: train DFlash block-diffusion speculative drafters, tracked in MLflow."""
__version__ = "0.1.0"
