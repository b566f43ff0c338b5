"""Generated protobuf/gRPC code of the KV transfer service (protos/pdserve/kv/v1/).

Never edit the *_pb2* modules by hand: change the .proto and run `python -m pdserve.kv.proto.generate`.
"""
