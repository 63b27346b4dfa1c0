"""llamarl.app.weights.layout: runs, buckets, packing and the flat-buffer views the sync sends whole."""

from __future__ import annotations

import torch

from llamarl.app.weights.layout import Layout, flatten_parameters_, pack, span_view

CPU = torch.device("cpu")


def separate_params() -> list[tuple[str, torch.Tensor]]:
    """One allocation each (as a trainer rank's shards would be): mixed dtypes and shapes."""
    g = torch.Generator().manual_seed(0)
    return [
        ("embed", torch.randn(40, 8, generator=g)),  # 1280 B: more than one 256 B bucket
        ("wq", torch.randn(8, 8, generator=g)),
        ("empty", torch.empty(0, 8)),
        ("w_bf16", torch.randn(4, 8, generator=g).bfloat16()),
        ("w_t", torch.randn(8, 6, generator=g).t()),  # non-contiguous
        ("scale", torch.tensor(3.0)),  # 0-d
    ]


def test_packed_buckets_carry_the_bytes_of_the_flat_run():
    params = separate_params()
    layout = Layout(params, bucket_bytes=256)
    assert [run.dtype for run in layout.runs] == [torch.float32, torch.bfloat16]
    float_run, bf16_run = layout.runs
    assert span_view(float_run, params, CPU) is None  # separate allocations: packed
    assert span_view(bf16_run, params, CPU) is not None  # one contiguous tensor is a flat run

    flat = [(n, p.clone()) for n, p in params]
    flatten_parameters_([p for _, p in flat])
    # embed (larger than a bucket) and wq (with an empty neighbour) are one tensor each and
    # go as they are; w_t is not contiguous and shares its bucket with scale: packed.
    assert [span_view(b, params, CPU) is not None for b in float_run.buckets] == [True, True, False]
    buffer = torch.empty(max(b.nbytes for b in float_run.buckets), dtype=torch.uint8)
    for run in layout.runs:
        view = span_view(run, flat, CPU)
        assert view is not None and view.numel() == run.numel
        sent = [span_view(b, params, CPU) for b in run.buckets]  # as the sender does
        sent = [x.clone() if x is not None else pack(b, params, buffer).clone()
                for x, b in zip(sent, run.buckets)]
        assert torch.equal(torch.cat(sent), view), run.dtype
    assert layout.nbytes == sum(p.numel() * p.element_size() for _, p in params)


def test_span_view_needs_layout_order_and_sees_a_rebinding():
    params = separate_params()
    flatten_parameters_([p for _, p in params])
    assert span_view(Layout(params, 256).runs[0], params, CPU) is not None
    # The same buffers, listed in another order: not the run the layout describes.
    assert span_view(Layout(params[::-1], 256).runs[0], params[::-1], CPU) is None
    params[1][1].data = params[1][1].detach().clone()
    assert span_view(Layout(params, 256).runs[0], params, CPU) is None


def test_parts_of_alone_bytes_or_more_are_buckets_of_their_own():
    """``alone_bytes`` below a bucket: such a part goes as it is between packed buckets
    (``sharded_alone`` of benchmarks/weight_sync.py); the bytes are the flat run's all the same."""
    params = separate_params()
    packed_run = Layout(params, bucket_bytes=1024).runs[0]
    run = Layout(params, bucket_bytes=1024, alone_bytes=200).runs[0]
    assert len(run.buckets) > len(packed_run.buckets)
    # embed (1280 B: more than a bucket) and wq (256 B >= 200) alone; w_t and scale packed together.
    assert [span_view(b, params, CPU) is not None for b in run.buckets] == [True, True, False]
    buffer = torch.empty(max(b.nbytes for b in run.buckets), dtype=torch.uint8)
    sent = [span_view(b, params, CPU) for b in run.buckets]
    sent = [x.clone() if x is not None else pack(b, params, buffer).clone() for x, b in zip(sent, run.buckets)]
    flat = [(n, p.clone()) for n, p in params]
    flatten_parameters_([p for _, p in flat])
    assert torch.equal(torch.cat(sent), span_view(run, flat, CPU))
