"""epdserve: disaggregated (Encode / Prefill / Decode) LLM serving engine."""

__version__ = "0.1.0"
