#!/usr/bin/env python3
"""An OTLP/gRPC trace endpoint that accepts and counts, for measuring the cost of tracing.

It answers every `TraceService/Export` with success without decoding the spans (so it costs
the machine as little as a receiver can), and prints the requests and bytes it took when
stopped. Jaeger or a Collector in its place would cost more CPU on the same machine.

    pip install grpcio
    python3 bench/otlp_sink.py --port 4317 &
    OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:4317 AIP_BIN_DIR=target/release \\
        BENCH_SCENARIOS=tasks bench/distributed.sh
"""

import argparse
import signal
import threading
from concurrent import futures

import grpc

SERVICE = "opentelemetry.proto.collector.trace.v1.TraceService"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=4317)
    args = parser.parse_args()

    taken = {"requests": 0, "bytes": 0}
    lock = threading.Lock()

    def export(request: bytes, _context) -> bytes:
        with lock:
            taken["requests"] += 1
            taken["bytes"] += len(request)
        return b""  # an empty ExportTraceServiceResponse: everything accepted

    handler = grpc.method_handlers_generic_handler(
        SERVICE,
        {"Export": grpc.unary_unary_rpc_method_handler(export)},
    )
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    server.add_generic_rpc_handlers((handler,))
    server.add_insecure_port(f"127.0.0.1:{args.port}")
    server.start()
    print(f"otlp sink on 127.0.0.1:{args.port}", flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    stop.wait()
    server.stop(1)
    print(f"otlp sink: {taken['requests']} export requests, {taken['bytes']} bytes", flush=True)


if __name__ == "__main__":
    main()
