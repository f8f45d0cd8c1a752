"""The on-disk format: layout math, the manifest, the safetensors tensor files and their I/O,
block checksums, files read from strangers, durable writes, and the checkpoint folder with its one
commit protocol. Imports only the package's base (errors, settings); no torch.distributed."""
