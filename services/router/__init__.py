"""The router: the public `pdserve.v1.Router` API, placement and the request lifecycle.

Never imports torch or transformers (tokenization uses the `tokenizers` library).
"""
