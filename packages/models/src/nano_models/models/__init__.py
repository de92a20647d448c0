"""Model architectures; importing this package registers them."""

from nano_models.models import llama, qwen2, qwen3, qwen3_moe  # noqa: F401
