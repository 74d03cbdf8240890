"""Training data from the user's own corpus: a token store and the source that packs it.

  python -m jaxpipe.data prepare --tokenizer WORKDIR|bytes --input FILE ... --out DIR
  python -m jaxpipe.train --config ... --config.data.source=tokens:DIR

`store` is the on-disk format (memory-mapped ids and document boundaries), `prepare` writes it
from JSONL, Parquet and text files with the model's tokenizer, and `source` packs whole documents
into training rows, step-indexed and resumable. The package sits above `jaxpipe.models` (the
tokenizer) and below `jaxpipe.training`, whose `data.source` setting names it.
"""
