"""Test harness pieces that stand in for a network: Linux network namespaces as hosts
(`netns.Topology`) and a TCP forwarder (`tcp_proxy.TcpForwarder`). Nothing here runs in production."""
