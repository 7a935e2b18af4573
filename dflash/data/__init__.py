"""What the target reads (DESIGN §5 "Data").

- `corpus`: Python source files split by a hash of their path into train / held-out (`load_corpus`,
  `split_of`, `CorpusConfig`), and the byte-level BPE tokenizer trainer used by the reference target.
- `sources`: the `data` config group — training sequences from the corpus, text files, synthetic data or the
  target's own continuations (`DataConfig`, `build_training_sequences`, `epoch_order`).
- `regen`: continuations written by the target itself, batched greedy generation, cached by fingerprint
  (`regenerate_sequences`, `greedy_generate`).
"""
