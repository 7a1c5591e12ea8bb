"""Helpers shared by the causal_attention op tests, one module per concept; import from the
module itself (this package exports nothing):

- ``parameters``: the dtypes the tests run in, their test ids, reproducible hypothesis settings;
- ``inputs``: random tensors in several memory layouts, ``Case`` (the shapes of a dense call),
  key masks, ALiBi slopes, sinks, ``ScoreOptions``;
- ``packed``: ``Packed`` (the shapes of a varlen call), cumulative lengths, padding to a batch;
- ``references``: SDPA with the op's semantics and the materialized float64 reference;
- ``tolerances``: unit roundoff, the round-off bound, FlashAttention's twice-SDPA's-error rule;
- ``results``: running a call for (out, dq, dk, dv[, dsinks]) and checking those results;
- ``shards``: which tests a shard of a run takes (``CAUSAL_ATTENTION_TEST_SHARD``);
- ``subprocesses``: running a script in a fresh interpreter.

Which keys a query row sees is ``causal_attention._masks.visible_keys``, the package's own."""
