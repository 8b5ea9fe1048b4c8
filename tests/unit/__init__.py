"""Fast single-process unit tests of p2p_diloco: no sockets, no DHT, no subprocesses."""
