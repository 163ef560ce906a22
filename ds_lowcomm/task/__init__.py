"""The reference task: byte-level transformer on a real text corpus, and its training loop."""
