"""Container HEALTHCHECK: exit 0 when the local server's grpc.health.v1 reports SERVING.

Kubernetes uses its native `grpc:` probes instead; this is for `docker run` / compose.
Checks 127.0.0.1:$SPECD_PORT, overall health (service "") unless an argument names a service.
With TLS on (SPECD_TLS_CERT) the gRPC port refuses plaintext, so set SPECD_HEALTH_PORT: the server
then serves grpc.health.v1 alone in plaintext there, and this checks that port instead.
"""

import os
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def main() -> int:
    health_port = int(os.environ.get("SPECD_HEALTH_PORT") or -1)
    port = health_port if health_port >= 0 else os.environ.get("SPECD_PORT", "50051")
    address = f"127.0.0.1:{port}"
    service = sys.argv[1] if len(sys.argv) > 1 else ""
    try:
        with grpc.insecure_channel(address) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=3)
    except grpc.RpcError as error:
        print(f"{address}: {error.code().name}", file=sys.stderr)
        return 1
    print(f"{address}: {health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)}")
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1


if __name__ == "__main__":
    sys.exit(main())
