"""The Open Inference Protocol over gRPC: messages (inference.proto), their conversion to
the v2 body the fleet carries (tensors.py), the service (servicer.py) and its server."""
