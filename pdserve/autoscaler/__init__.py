"""Independent scaling of the prefill and decode pools (pure policy + controller)."""
