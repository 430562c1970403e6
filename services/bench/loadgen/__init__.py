"""`pdserve bench serve`: a serving benchmark a user runs against their own deployment (a pdserve
router over gRPC, or any OpenAI-compatible server over HTTP), with seeded workloads, arrival
processes, latency summaries and goodput under SLOs. Never imports torch."""
