"""The middle-stage role: layers a:b between a head and a tail (`shardflow stage`, workers/stage/server.py)."""
