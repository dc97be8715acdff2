"""Model surgery and files: layer records, module swapping, conversion, checkpoints, pretrained
folders, checkpoint reports."""
