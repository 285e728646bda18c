"""The tune pipeline: prepare the float model, quantize every candidate, measure each as deployed, choose."""
