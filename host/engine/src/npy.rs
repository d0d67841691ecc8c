//! Writing float32 arrays as NumPy `.npy` (version 1.0), for the eval commands.

use std::io::Write;

/// Serialises a C-order little-endian float32 array of `shape`.
pub fn write_f32(w: &mut impl Write, shape: &[usize], data: &[f32]) -> std::io::Result<()> {
    assert_eq!(
        shape.iter().product::<usize>(),
        data.len(),
        "npy shape/data mismatch"
    );
    let dims: Vec<String> = shape.iter().map(|d| d.to_string()).collect();
    let shape_txt = if dims.len() == 1 {
        format!("({},)", dims[0])
    } else {
        format!("({})", dims.join(", "))
    };
    let mut header = format!("{{'descr': '<f4', 'fortran_order': False, 'shape': {shape_txt}, }}");
    // Magic (6) + version (2) + length (2) + header + '\n' must be a multiple of 64.
    let pad = (64 - (10 + header.len() + 1) % 64) % 64;
    header.push_str(&" ".repeat(pad));
    header.push('\n');
    w.write_all(b"\x93NUMPY\x01\x00")?;
    w.write_all(&(header.len() as u16).to_le_bytes())?;
    w.write_all(header.as_bytes())?;
    for v in data {
        w.write_all(&v.to_le_bytes())?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn header_is_aligned_and_data_follows() {
        let mut out = Vec::new();
        super::write_f32(&mut out, &[2, 3], &[1., 2., 3., 4., 5., 6.]).unwrap();
        let hlen = u16::from_le_bytes([out[8], out[9]]) as usize;
        assert_eq!((10 + hlen) % 64, 0);
        assert!(std::str::from_utf8(&out[10..10 + hlen])
            .unwrap()
            .contains("'shape': (2, 3)"));
        assert_eq!(out.len(), 10 + hlen + 24);
    }
}
