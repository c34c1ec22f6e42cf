"""The model: `gpt` (the layers' modules), the block variants (`moe`, `mod`, `hashattn`) and
`layers` (the model as a list of pipeline-movable layers: specs, the block table, building)."""
