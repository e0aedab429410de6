from xstage_lab.experiments.moe.layer_profile import boundary_into_us


def test_the_boundary_into_a_kernel_is_from_the_kernels_before_it_only():
    fill, fused = "void at::native::vectorized_elementwise_kernel<4, FillFunctor<int>>", "moe"
    boundaries = {f"{fill} -> {fused}": 0.5, f"{fused} -> {fill}": 0.25, f"{fused} -> {fused}": 2.0,
                  "route_tiny -> moe": 1.0, "moe_x -> route_tiny": 4.0}
    assert boundary_into_us(boundaries, fused) == 1.5  # the fill's and route_tiny's
    assert boundary_into_us({f"{fused} -> {fill}": 0.25}, fused) == 0.0
