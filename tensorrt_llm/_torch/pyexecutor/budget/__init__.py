"""The token-budget policies (``policies``: none, trim, fit, recheck, claim) and the re-check itself
(``recheck``: one pure function that charges full forward costs before any KV allocation)."""
