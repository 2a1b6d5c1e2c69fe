"""Message transport between processes (L1). Importing this package needs pyzmq: only server code does."""
