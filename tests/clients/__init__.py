"""Client programs the end-to-end tests run in a process of their own.

tritonclient.grpc and the KServe SDK each register the protocol's messages under the
same protobuf names (package ``inference``), and protobuf refuses a second definition
in one process; the KServe SDK is imported by the test processes, so tritonclient.grpc
runs here, as Triton's gRPC examples would run it: a separate program."""
