"""pagechat's engine: model, paged KV blocks, scheduler, sampler and speculation."""
