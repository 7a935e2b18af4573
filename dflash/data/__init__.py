"""What the target reads (docs/DESIGN.md, "The data path"; docs/data.md).

- `corpus`: Python source files (the standard library, or with `scope=installed` every installed package too),
  deduplicated by content, split by a hash of their path into train / val / test (`load_corpus`, `split_of`,
  `CorpusConfig`, `CORPUS_SCOPES`), fingerprinted; tokenized once into a checked cache (`tokenize_corpus`);
  the byte-level BPE tokenizer trainer used by the reference target (`train_tokenizer`, `tokenizer_sample`).
- `sources`: the `data` config group — training sequences from the corpus, text files, synthetic data or the
  target's own continuations (`DataConfig`, `build_training_sequences`, `epoch_order`).
- `regen`: continuations written by the target itself, batched greedy generation, cached by fingerprint
  (`regenerate_sequences`, `greedy_generate`).
"""
