"""A request's side: encoding (tokens, spans, the budget), images (checks, decoding, preprocessing),
answers (probabilities -> System One bodies) and the routing prefix key."""
