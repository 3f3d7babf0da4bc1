"""The HTTP surfaces, a router each: System One (the contract's decision and models routes), Cloudflare's Workers
AI route, the runtime adapter admin routes (vLLM's), the probes and metrics. Each maps HTTP onto the server's
context (app.context) and nothing more."""
