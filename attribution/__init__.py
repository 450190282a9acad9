"""Attribution methods built on :mod:`hooks`: each call registers and removes its own hook group."""

__all__: list[str] = []
