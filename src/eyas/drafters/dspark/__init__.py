"""DSpark: DFlash's block drafter plus a Markov head that conditions each block position on
the token drafted before it, and a confidence head that predicts each position's acceptance
(`model`, `kind`, `options`)."""
