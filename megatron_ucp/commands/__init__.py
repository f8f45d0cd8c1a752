"""The commands whose code had no home in the library (inspect, Hugging Face export/import,
the GPU check); `megatron_ucp.cli` dispatches to them and to the converters' own commands."""
