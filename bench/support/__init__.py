"""What the benchmarks share: publishers and event streams (service_stream, zmtp_pub), the services
they start (service_procs), report tables (service_report), peers (sglang_peer), traces
(mooncake_trace) and the /health probe process (health_probe)."""
