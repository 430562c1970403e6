"""The router: the public `pdserve.v1.Router` API, placement and the request lifecycle.

Never imports torch: it tokenizes with transformers' AutoTokenizer in transformers'
tokenizer-only mode (see `tokenizer.py`), importing transformers only to load the tokenizer.
"""
