"""Where bytes live: locations on any kvstore, safe local files, the writer lock,
server-side copies, run ownership of places."""
