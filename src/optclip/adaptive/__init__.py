"""Clips whose threshold follows the gradients' history: `adagc`, `agc`, `autoclip`, `zclip`.

Each is an Optax transformation whose state holds the history as arrays; each reads the norms of
`optclip.norms` and the shared state helpers of `optclip.clips`.
"""
