"""The gRPC transport: a server and its clients as separate processes (see docs/deployment.md).

:class:`~fedweave.transports.grpc.server.GrpcServerTransport` is the server's
:class:`~fedweave.transports.base.Transport`; :class:`~fedweave.transports.grpc.client.GrpcClient`
serves one client's work in its own process. Both need the ``grpc`` extra.
"""
