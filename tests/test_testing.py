"""lora_ops.testing: its comparison with the float64 oracle (check_against_reference), which every parity test uses,
and the adapter sizes of its batches."""
import torch

from lora_ops import testing


def test_a_cancelled_sum_may_leave_a_residue_only_in_a_row_the_op_writes():
    """bf16 products can sum to exactly 0: the oracle then leaves y[0, 1] as it was while a kernel's float32
    rounding moves it by a residue (CI, seed 148186215: 9.5e-9). That is allowed in a row the op writes, within
    the tolerance of the row's change; a row it does not write, a move past that bound and a NaN poison stay
    bitwise."""
    before = torch.ones(2, 4)
    ref = before.double().clone()
    ref[0] = torch.tensor([2.0, 1.0, 2.0, 2.0], dtype=torch.float64)  # row 0 written; y[0, 1] gains exactly 0
    out = ref.float()
    check = lambda o, b=before, r=ref: testing.check_against_reference(o, b, r, torch.bfloat16)
    assert check(out) == ""
    residue = out.clone()
    residue[0, 1] += 1e-6  # 1e-6 <= 5e-5 (bf16 inputs, float32 y) times the row's largest change, 1
    assert check(residue) == ""
    unwritten_row = residue.clone()
    unwritten_row[1, 2] += 1e-6
    assert check(unwritten_row) == "1 elements outside the LoRA rows/columns changed"
    too_far = out.clone()
    too_far[0, 1] += 1e-3
    assert check(too_far) == "1 elements outside the LoRA rows/columns changed"
    poisoned = before.clone()
    poisoned[0, 1] = float("nan")
    ref_poisoned = ref.clone()
    ref_poisoned[0, 1] = float("nan")
    assert check(residue, poisoned, ref_poisoned) == "1 elements outside the LoRA rows/columns changed"


def test_padded_views_sit_in_nan_storage_with_other_strides():
    """padded(): the values as a view whose storage around them is NaN (a kernel reading past the view picks up
    NaN), every stride but the last unlike the contiguous one."""
    values = torch.arange(6.0).view(2, 3)
    view = testing.padded(values, 2, "cpu")
    assert torch.equal(view, values) and view.stride() == (7, 1)
    storage = testing.storage_snapshot(view)
    inside = torch.zeros(storage.numel(), dtype=torch.bool)
    inside.as_strided(view.shape, view.stride(), view.storage_offset()).fill_(True)
    assert storage[~inside].isnan().all() and storage.numel() == 6 * 7
    assert testing.padded(values, 0, "cpu").is_contiguous()


def test_check_outside_view_finds_a_write_past_the_view():
    """check_outside_view: a change in y's row padding or a neighbouring column is reported, one inside y is not,
    and a NaN kept as NaN is no change (bitwise)."""
    y = testing.padded(torch.zeros(3, 4), 1, "cpu")
    around = testing.storage_snapshot(y)
    y += 1
    assert testing.check_outside_view(y, around) == ""
    neighbour = y.as_strided((1,), (1,), y.storage_offset() + 4)  # the column right of row 0
    neighbour.fill_(5.0)
    assert testing.check_outside_view(y, around) == ("1 elements outside the view (row padding, neighbouring "
                                                     "columns) changed")


def test_drawn_sizes_put_every_adapter_on_a_row_and_the_rest_at_random():
    """drawn_sizes: one token each (the first num_tokens adapters where there are fewer tokens), the others drawn, so
    the sizes sum to the tokens and, over many tokens, differ (an even spread would be [16] * 4)."""
    gen = torch.Generator().manual_seed(5)
    sizes = testing.drawn_sizes(64, 4, gen)
    assert sum(sizes) == 64 and min(sizes) >= 1 and len(set(sizes)) > 1
    assert testing.drawn_sizes(3, 5, gen) == [1, 1, 1, 0, 0]
    assert testing.drawn_sizes(5, 5, gen) == [1] * 5
    draws = [testing.drawn_sizes(20, 6, torch.Generator().manual_seed(k)) for k in (7, 7, 8)]
    assert draws[0] == draws[1] != draws[2]  # the generator's, nothing else's
