"""The weight plane: policy weights straight from trainer ranks to generators (DDMA).

Two calls are its whole surface to the roles: ``publisher.Publisher.publish(version)`` on
every trainer rank and ``subscriber.Subscriber.swap_into(model)`` on a generator. Beneath
them: ``epochs`` (a new set of weight groups per membership epoch, led by trainer rank 0;
a generator joins each one inside its ``Subscriber``); ``group`` (one process group, its
rendezvous, layout handshake and sync announcements), ``sender`` and ``receiver`` (its two
ends); ``layout`` (where each parameter's bytes sit) and ``shards`` (which part each
trainer rank sends); ``digest`` (the signed digest a generator checks before it swaps).
May import ``control``, ``sampling`` (the generator's quantized refresh) and the base
modules; not ``rl``, ``data`` or ``roles``.
"""
