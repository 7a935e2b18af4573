"""Driving a Hugging Face decoder with its own cache (generation, verification): one place that knows the
cache class and the name of the cache argument across transformers versions."""
from __future__ import annotations

import inspect

def new_hf_cache(decoder):
    from transformers import DynamicCache
    try:
        return DynamicCache(config=decoder.config)
    except TypeError:  # older signature
        return DynamicCache()


def cache_kwarg(decoder) -> str:
    """The decoder's cache argument: `past_key_values`, renamed `cache` in recent transformers."""
    try:
        params = inspect.signature(decoder.forward).parameters
    except (TypeError, ValueError):
        return "past_key_values"
    return "cache" if "cache" in params and "past_key_values" not in params else "past_key_values"


