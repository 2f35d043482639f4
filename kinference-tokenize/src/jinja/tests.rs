use super::*;

fn render(template: &str, ctx: &serde_json::Value) -> Result<String, Error> {
    let env = environment(template)?;
    env.get_template(TEMPLATE_NAME)?.render(json_to_value(ctx))
}

#[test]
fn float_repr_matches_python() {
    for (f, want) in [
        (1.0, "1.0"),
        (2.5, "2.5"),
        (-0.0, "-0.0"),
        (0.0, "0.0"),
        (1e-7, "1e-07"),
        (1.5e-7, "1.5e-07"),
        (0.0001, "0.0001"),
        (0.00001, "1e-05"),
        (1000.0, "1000.0"),
        (1e15, "1000000000000000.0"),
        (1e16, "1e+16"),
        (1.234_567_890_123_456_8e22, "1.2345678901234568e+22"),
        (123_456.789, "123456.789"),
        (0.1, "0.1"),
        (-3.25, "-3.25"),
        (f64::INFINITY, "Infinity"),
        (f64::NEG_INFINITY, "-Infinity"),
        (f64::NAN, "NaN"),
        (5e-324, "5e-324"),
        (1.797_693_134_862_315_7e308, "1.7976931348623157e+308"),
    ] {
        assert_eq!(py_float_repr(f), want, "{f:e}");
    }
}

#[test]
fn tojson_prints_like_python_json_dumps() {
    let ctx = serde_json::json!({
        "x": {"b": 1, "a": [1.0, 2.5, null, true, "<&>'\u{e9}\n\u{1}\u{7f}"], "c": {}}
    });
    assert_eq!(
        render("{{ x | tojson }}", &ctx).unwrap(),
        "{\"b\": 1, \"a\": [1.0, 2.5, null, true, \"<&>'\u{e9}\\n\\u0001\u{7f}\"], \"c\": {}}"
    );
    assert_eq!(
        render("{{ x | tojson(ensure_ascii=true, sort_keys=true) }}", &ctx).unwrap(),
        "{\"a\": [1.0, 2.5, null, true, \"<&>'\\u00e9\\n\\u0001\\u007f\"], \"b\": 1, \"c\": {}}"
    );
    assert_eq!(
        render("{{ [1, {'k': []}] | tojson(indent=2) }}", &ctx).unwrap(),
        "[\n  1,\n  {\n    \"k\": []\n  }\n]"
    );
    assert_eq!(
        render(
            "{{ {'a': 1, 'b': 2} | tojson(separators=(',', ':')) }}",
            &ctx
        )
        .unwrap(),
        "{\"a\":1,\"b\":2}"
    );
    let err = render("{{ nothing | tojson }}", &ctx).unwrap_err();
    assert!(err.to_string().contains("not JSON serializable"), "{err}");
}

#[test]
fn raise_exception_carries_its_message() {
    let err = render(
        "{{ raise_exception('Roles must alternate!') }}",
        &serde_json::json!({}),
    )
    .unwrap_err();
    assert_eq!(
        raised_message(&err).as_deref(),
        Some("Roles must alternate!")
    );
    let other = render("{{ x.y.z }}", &serde_json::json!({})).unwrap_err();
    assert_eq!(raised_message(&other), None);
}

#[test]
fn whitespace_control_is_transformers() {
    let t = "{% for m in messages %}\n  {{ m }}\n{% endfor %}\n";
    assert_eq!(
        render(t, &serde_json::json!({"messages": ["a", "b"]})).unwrap(),
        "  a\n  b\n"
    );
}

#[test]
fn generation_blocks_render_their_body() {
    let t = "A{%- generation -%}  B  {%- endgeneration -%} C{% generation %}D{% endgeneration %}";
    assert_eq!(render(t, &serde_json::json!({})).unwrap(), "ABCD");
}

#[test]
fn python_methods_and_reprs() {
    let t =
        "{{ s.strip() }}|{{ s.startswith(' a') }}|{{ d.items() | list | length }}|{{ n }}|{{ b }}";
    let ctx = serde_json::json!({"s": " ab ", "d": {"k": 1}, "n": null, "b": true});
    assert_eq!(render(t, &ctx).unwrap(), "ab|True|1|None|True");
}

#[test]
fn strftime_formats_like_c() {
    // 2024-02-29T13:05:09Z was a Thursday.
    let t = 1_709_211_909;
    assert_eq!(
        strftime("%Y-%m-%d %H:%M:%S %j %a %A %b %B %p %I %y %%", t),
        "2024-02-29 13:05:09 060 Thu Thursday Feb February PM 01 24 %"
    );
    assert_eq!(strftime("%-d %b %Y|%e|%Q", t), "29 Feb 2024|29|%Q");
    assert_eq!(strftime("%d %B %Y", 0), "01 January 1970");
    assert_eq!(strftime("%A", 86_400 * 4), "Monday");
}

#[test]
fn content_format_detection() {
    assert_eq!(
        detect_content_format("{% for message in messages %}{{ message.content }}{% endfor %}"),
        ContentFormat::String
    );
    assert_eq!(
        detect_content_format(
            "{%- for message in messages %}{%- for part in message['content'] %}{{ part.text }}{% endfor %}{% endfor %}"
        ),
        ContentFormat::OpenAi
    );
    assert_eq!(
        detect_content_format(
            "{% set loop_messages = messages[1:] %}{% set ms = loop_messages | list %}{%- for turn in ms if turn.role != 'x' %}{% for p in turn['content'] | list %}{{ p.text }}{% endfor %}{% endfor %}"
        ),
        ContentFormat::OpenAi
    );
    // vLLM does not follow aliases of the content itself (Mistral's
    // `set tool_calls = message.content`), nor loops over other lists.
    assert_eq!(
        detect_content_format(
            "{% for m in messages %}{% set c = m.content %}{% for p in c %}{% endfor %}{% for t in m.tool_calls %}{% endfor %}{% for x in m.contents %}{% endfor %}{% endfor %}"
        ),
        ContentFormat::String
    );
    // Only loop variables over the messages count.
    assert_eq!(
        detect_content_format("{% for p in message.content %}{% endfor %}"),
        ContentFormat::String
    );
}

#[test]
fn json_values_keep_key_order_and_number_kinds() {
    let ctx = serde_json::json!({"x": {"z": 1, "a": 2.0, "m": 18_446_744_073_709_551_615_u64}});
    assert_eq!(
        render("{{ x | tojson }}", &ctx).unwrap(),
        "{\"z\": 1, \"a\": 2.0, \"m\": 18446744073709551615}"
    );
}
