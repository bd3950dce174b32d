"""The language-neutral contract: Avro schemas (`avro/*.avsc`) and every registered older version
(`registered/*.avsc`).

Files only: `domain/codec.py` reads them at run time and `native/` at build time. A changed schema
is registered with `python -m schemas.register` (see `register.py`).
"""
