"""Foreign formats: Orbax and msgpack readers, safetensors, importing as steps."""
