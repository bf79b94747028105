"""Shard inputs for userdp: reading a user-partitioned corpus, tokenizing it, and writing the
user-partitioned Arrow shards the workers hold (``userdp shard``), plus the embedded demo corpus."""
