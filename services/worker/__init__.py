"""Worker plumbing shared by the prefill, decode and co-located services: their common config
and start-up, the client of the host's kvtransfer agent, the decode-side lease book, token
streams, proto <-> domain conversion, and the Prefill / Decode servicers. It joins the engine
(torch, no networking) to gRPC; service packages compose it and never import each other."""
