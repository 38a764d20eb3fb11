"""Op programs of the fused host update written by hand (AdamW, copy, write) for calibration."""

from __future__ import annotations

import numpy as np

from jaxtier._src.primitives import host_update as hu


def adamw_program(*, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
                  weight_decay: float = 1e-4) -> hu.Program:
  """The op program of one optax.adamw step on an fp32 master copy (calibration, tests, benchmarks).

  The same fp32 operations in the same order as `optax.adamw` (eps_root = 0) followed by
  `optax.apply_updates`.

  Operands: 0 master [N] f32, 1 mu [N] f32, 2 nu [N] f32, 3 grad [N] (any supported dtype),
  4 learning rate [1] f32, 5 `1 - b1**t` [1] f32, 6 `1 - b2**t` [1] f32.
  Results: 0 new master (alias operand 0), 1 new mu (alias 1), 2 new nu (alias 2), 3 the new
  param [N] rounded to its own dtype (e.g. bf16, for the device).
  Aliases: [0, 1, 2, -1].

  Args:
    b1, b2, eps, weight_decay: as in `optax.adamw`.

  Returns:
    The program (7 operands, 4 results).
  """
  op = hu.Op
  consts = np.asarray([b1, 1 - b1, b2, 1 - b2, eps, weight_decay], np.float32)
  code = [
      (op.LOAD, 0, 0, 0, 0),   # r0 = master
      (op.LOAD, 1, 1, 0, 0),   # r1 = mu
      (op.LOAD, 2, 2, 0, 0),   # r2 = nu
      (op.LOAD, 3, 3, 0, 0),   # r3 = g
      (op.CONST, 4, 0, 0, 0),  # b1
      (op.CONST, 5, 1, 0, 0),  # 1 - b1
      (op.MUL, 6, 5, 3, 0),    # (1 - b1) * g
      (op.MUL, 7, 4, 1, 0),    # b1 * mu
      (op.ADD, 1, 6, 7, 0),    # mu' = (1 - b1) * g + b1 * mu
      (op.MUL, 8, 3, 3, 0),    # g ** 2
      (op.CONST, 4, 2, 0, 0),  # b2
      (op.CONST, 5, 3, 0, 0),  # 1 - b2
      (op.MUL, 6, 5, 8, 0),    # (1 - b2) * g**2
      (op.MUL, 7, 4, 2, 0),    # b2 * nu
      (op.ADD, 2, 6, 7, 0),    # nu' = (1 - b2) * g**2 + b2 * nu
      (op.LOAD, 9, 5, 0, 0),   # 1 - b1**t
      (op.DIV, 10, 1, 9, 0),   # mu_hat
      (op.LOAD, 9, 6, 0, 0),   # 1 - b2**t
      (op.DIV, 11, 2, 9, 0),   # nu_hat
      (op.SQRT, 12, 11, 0, 0),
      (op.CONST, 4, 4, 0, 0),  # eps
      (op.ADD, 12, 12, 4, 0),  # sqrt(nu_hat) + eps
      (op.DIV, 13, 10, 12, 0),  # u = mu_hat / (sqrt(nu_hat) + eps)
      (op.CONST, 4, 5, 0, 0),  # weight decay
      (op.MUL, 14, 4, 0, 0),   # wd * master
      (op.ADD, 13, 13, 14, 0),  # u + wd * master
      (op.LOAD, 9, 4, 0, 0),   # lr
      (op.NEG, 9, 9, 0, 0),    # -lr
      (op.MUL, 13, 13, 9, 0),  # u * -lr
      (op.ADD, 0, 0, 13, 0),   # master' = master + u
      (op.STORE, 0, 0, 0, 0),
      (op.STORE, 1, 1, 0, 0),
      (op.STORE, 2, 2, 0, 0),
      (op.STORE, 3, 0, 0, 0),
  ]
  return hu.Program(code=np.asarray(code, np.int32), consts=consts, num_regs=15,
                    num_operands=7, num_results=4)


ADAMW_ALIASES = (0, 1, 2, -1)


def _copy_program() -> hu.Program:
  """result[0][i] = operand[0][i]: one read and one write per element."""
  code = np.asarray([[hu.Op.LOAD, 0, 0, 0, 0], [hu.Op.STORE, 0, 0, 0, 0]], np.int32)
  return hu.Program(code=code, consts=np.zeros(1, np.float32), num_regs=1, num_operands=1,
                    num_results=1)


def _write_program() -> hu.Program:
  """result[0][i] = operand[1][i] (result 0 aliases operand 0, which is not read)."""
  code = np.asarray([[hu.Op.LOAD, 0, 1, 0, 0], [hu.Op.STORE, 0, 0, 0, 0]], np.int32)
  return hu.Program(code=code, consts=np.zeros(1, np.float32), num_regs=1, num_operands=2,
                    num_results=1)
