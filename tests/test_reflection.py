"""Server reflection: a client that has no .proto (as grpcurl) lists the
daemon's services, reads their schema and calls them."""

from __future__ import annotations

import grpc
from google.protobuf.descriptor_pool import DescriptorPool
from google.protobuf.message_factory import GetMessageClass
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

import kvdepot
from kvdepot.proto import kvdepot_pb2 as pb


def call(channel: grpc.Channel, schema: DescriptorPool, method_name: str, **fields):
    """A unary call whose request and answer types come from the reflected schema alone."""
    service_name, method = method_name.rsplit(".", 1)
    descriptor = schema.FindServiceByName(service_name).methods_by_name[method]
    request_class = GetMessageClass(descriptor.input_type)
    answer_class = GetMessageClass(descriptor.output_type)
    stub = channel.unary_unary(
        f"/{service_name}/{method}",
        request_serializer=request_class.SerializeToString,
        response_deserializer=answer_class.FromString,
    )
    return stub(request_class(**fields), timeout=10)


def test_a_client_without_the_proto_lists_reads_and_calls_the_service(daemon):
    with grpc.insecure_channel("unix:" + daemon.socket) as channel:
        reflected = ProtoReflectionDescriptorDatabase(channel)
        services = set(reflected.get_services())
        assert {"kvdepot.v1.KVDepot", "grpc.health.v1.Health"} <= services
        schema = DescriptorPool(reflected)

        service = schema.FindServiceByName("kvdepot.v1.KVDepot")
        assert {m.name for m in service.methods} == {m.name for m in pb.DESCRIPTOR.services_by_name["KVDepot"].methods}
        get_stats = service.methods_by_name["GetStats"]
        assert get_stats.input_type.full_name == "kvdepot.v1.GetStatsRequest"
        assert not get_stats.server_streaming and service.methods_by_name["Attach"].server_streaming
        answer_fields = {f.name: f.number for f in get_stats.output_type.fields}
        assert answer_fields["daemon_instance"] == 2 and answer_fields["pool"] == 4
        assert {"slot_bytes", "num_slots", "pinned"} <= set(get_stats.output_type.fields_by_name["pool"].message_type
                                                            .fields_by_name)

        # Without a session a caller sees the pool alone: enough to check the
        # answer is the daemon's (4 MiB of 16 KiB slots, the tests' default).
        stats = call(channel, schema, "kvdepot.v1.KVDepot.GetStats")
        assert stats.daemon_version == kvdepot.__version__
        assert (stats.pool.num_slots, stats.pool.slot_bytes) == (256, 16 * 1024)
        assert stats.eviction_policy == "lru" and stats.used_slots == 0

        health = call(channel, schema, "grpc.health.v1.Health.Check", service="kvdepot.v1.KVDepot")
        assert health.DESCRIPTOR.fields_by_name["status"].enum_type.values_by_number[health.status].name == "SERVING"
