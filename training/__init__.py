"""The training job: a small byte-level GPT trained with our attention op or with torch's SDPA.

- ``python -m training.train``: one training run (``train.py``), on the bytes of Python's
  standard library (``byte_corpus.py``), logging every step to CSV (``training_log.py``);
- ``python -m training.compare_runs``: how closely runs' loss curves agree, and their speed;
- ``bash scripts/run.sh`` (with the other entry points, test.sh and sanitize.sh): the main job,
  the same run on both attentions, then the comparison.
"""
